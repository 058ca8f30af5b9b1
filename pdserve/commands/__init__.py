"""CLI command modules. Each module registers its commands on the shared Typer apps in
:mod:`pdserve.apps`; :mod:`pdserve.cli` imports every module here, so adding a command is
adding a file. Heavy imports (vLLM, Ray, Redis) stay inside the command functions.
"""
