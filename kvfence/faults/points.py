"""The named fault points: those that switch one guard off and those that make a component
misbehave. Names only; what an action point does lives in effects.py."""

from __future__ import annotations

# Points that switch one guard off (the twins), and that guard.
GUARD_POINTS = {
    "skip_admission": "admission",  # admit() lets everything in (I1)
    "skip_tag_check": "tag_check",  # runner and transfer-source ownership checks pass all (I2)
    "skip_dest_check": "dest_check",  # decode writes a transfer's pages whoever owns them (I2)
    "skip_count_check": "count_check",  # decode commits whatever counts DONE reports (I3)
    "skip_checksum": "checksum",  # decode ignores page checksums and the read-back digest (I3)
    "early_release": "deferred_release",  # decode frees an aborted room before the fence (I4)
    "drop_abort_ack": "abort_ack",  # prefill never acknowledges an ABORT (I4, liveness)
    "skip_peer_verify": "peer_verify",  # TLS peers are not verified: any certificate passes (I8)
    "skip_pairing_check": "pairing_check",  # prefill and decode pair whatever they exchanged (I7)
    "tenant_from_header": "credential_tenant",  # the HTTP layer believes an X-Tenant header (I6)
    # Prefix-cache keys and the sealed-page read check leave the namespace out (I2, I6).
    "prefix_cache_ignore_namespace": "prefix_namespace",
    # A cached page is reused on a key match alone, its stored tokens not compared (I2).
    "prefix_cache_skip_token_compare": "prefix_token_compare",
    # PD prefill takes RESERVE's cached-prefix claim without recomputing its digest (I2, I3).
    "skip_prefix_digest": "prefix_digest",
    # The router's prefix index keys every tenant's prompts alike: B is routed by A's prefixes.
    "router_ignore_tenant": "router_tenant",
    # The sampler ignores structured-output masks (the engine must then fail the row closed).
    "skip_grammar_mask": "grammar_mask",
    "unfair_admission": "fair_share",  # the scheduler admits the queue's head, FIFO
    "unbounded_output": "output_bound",  # a slow reader's events pile up without limit
    "skip_operator_check": "operator_credential",  # internal endpoints open to any caller
    "skip_hop_check": "hop_signature",  # decode dials whatever X-Kvfence-Prefill names
    # The PD pool port lets any thread call anything on any grant (pd/pool_port.py).
    "skip_port_rule": "port_rule",
    # PD decode answers 200 without the prompt logprobs its client asked for (I5)
    "skip_prompt_logprobs_check": "prompt_logprobs_whole",
    # Prefix-cache namespaces leave the LoRA adapter's digest out: adapters share pages (I2).
    "lora_key_drops_digest": "lora_digest",
    # PD decode commits a transfer whatever adapter digest prefill says it applied (I3).
    "lora_skip_pd_digest": "lora_pd_digest",
    # The engine starts whatever the boot warm-up left held or cached in the pool (I7).
    "skip_warmup_check": "warmup_returned",
}
# Points that make a component misbehave.
ACTION_POINTS = frozenset(
    {
        "corrupt_page",  # prefill flips a byte of a page after checksumming it (I3)
        "truncate_transfer",  # prefill sends only the first page, and a DONE that agrees (I3)
        "stall_transfer",  # prefill waits stall_s before sending pages: a window for kills/aborts
        "placeholder_on_reject",  # the incident: prefill swaps a request it rejected for a
        #                           1-token placeholder that continues through compute and transfer
        "late_write",  # prefill keeps sending a room's pages after it acknowledged the abort (I4)
        "kill_prefill",  # the prefill process crashes right after sending a room's first page
        "kill_decode",  # the decode process crashes right after applying a room's first page
        "client_disconnect",  # decode's client goes away right after its RESERVE was sent
        "write_sealed_page",  # the scheduler points a request's new tokens at a sealed page (I2)
        "stale_cached_page",  # a PD decode's cached prefix page changes under a room after its
        #                       RESERVE went out (I3: the read-back covers cached pages too)
        # Tensor parallelism (I2 across ranks): the rank where it is armed contributes no fail
        # flags to the batch's combined check (as if it skipped the check), and on rank 0 of a
        # PD decode it skips the transfer's destination check ...
        "tp_rank_skips_tag_check",
        # ... and rank 0's flags decide alone, not combined with the others' (the twin); a PD
        # decode's other ranks then write every page rank 0 accepted, checking nothing.
        "tp_leader_decides_alone",
        # A tensor-parallel PD decode's last rank scrambles its slice of the first page of each
        # run it writes, after the run's checksums passed (I3: the read-back covers every rank).
        "tp_corrupt_rank_slice",
        "drop_prompt_logprobs",  # prefill's DONE leaves out the prompt logprobs decode awaits
        "warmup_keeps_pages",  # the boot warm-up returns all its rows' pages but the last's
    }
)
POINTS = frozenset(GUARD_POINTS) | ACTION_POINTS
