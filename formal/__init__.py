"""The model checker of the KV transfer protocol: an explicit-state explorer (explorer.py) over a
world (model.py) whose transitions call kvfence.pd.protocol's own state machines."""
