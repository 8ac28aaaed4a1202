"""The Python API (`import memplan; memplan.estimate(...)`), the layer between the report and the command line:
the options the CLI takes, as keyword arguments, turned into plans, estimates and searches with typed results.

Its modules load only what their calls need (the `memplan` command imports one of them per command):
values (option values: sizes, token counts, --mst; light), options (the shared plan options -> a config),
estimating (estimate, max_seq, max_micro_batch), explaining (explain), searching (search), catalog (the presets,
config.json files, `memplan impls`), checks (`memplan validate`). This __init__ imports none of them; memplan/__init__.py exposes the calls lazily.
"""
