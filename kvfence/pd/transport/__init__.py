"""KV transfer backends behind one small interface (tcp; mooncake)."""
