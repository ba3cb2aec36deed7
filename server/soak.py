"""`python -m jaxinfer.server.soak`: the command's documented name; the tool is `jaxinfer.tools.soak`."""

if __name__ == "__main__":
    from jaxinfer.tools.soak import main

    raise SystemExit(main())
