"""PD disaggregation: the transfer protocol, its wire format, and the prefill/decode services."""
