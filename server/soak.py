"""`python -m jaxinfer.server.soak`: the command's documented name; the tool is `jaxinfer.tools.soak`.

It runs that module as the program (runpy), so this alias adds no import from the server to the tools.
"""

if __name__ == "__main__":
    import runpy

    runpy.run_module("jaxinfer.tools.soak", run_name="__main__", alter_sys=True)
