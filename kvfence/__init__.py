"""kvfence: a PD-disaggregated LLM serving engine with tenant-fenced KV pages."""
