"""Structured outputs: constraint specs, grammar compilation (llguidance) and token masks."""
