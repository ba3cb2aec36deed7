"""`python -m jaxinfer.device_check`: the command's documented name; the tool is `jaxinfer.tools.device_check`.

It runs that module as the program (runpy), so this alias adds no import to the house's graph.
"""

if __name__ == "__main__":
    import runpy

    runpy.run_module("jaxinfer.tools.device_check", run_name="__main__", alter_sys=True)
