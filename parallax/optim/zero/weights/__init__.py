"""The weights between steps: ZeRO-3's shards and gathers, the deferred all-gathers of 1 and 2."""
