"""`python -m jaxinfer.device_check`: the command's documented name; the tool is `jaxinfer.tools.device_check`."""

if __name__ == "__main__":
    from jaxinfer.tools.device_check import main

    raise SystemExit(main())
