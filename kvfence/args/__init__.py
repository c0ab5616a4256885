"""Every command-line option of a node, defined once. `kvfence serve`, `preflight`, `up` and the
router add these specs to their parsers; `node_argv` writes a NodeConfig back as a command line
(`up`'s workers). Each option's default is read from its field of EngineConfig, ServerConfig,
PdConfig or RoutingConfig, so a default lives only there: a new flag is an Option in the table of
its config and a field there, nothing else.

- option.py: `Option` (one flag: spellings, destination, parsing), `add_options`, `command_line`.
- engine.py, server.py, pd.py, routing.py: the tables, one per config the options land in.
- node.py: a whole node's options (`NODE_OPTIONS`) and `node_argv`.
"""
