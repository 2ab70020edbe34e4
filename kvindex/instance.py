"""What names an instance: one (worker id, data-parallel rank) pair, the unit a router sends requests
to. Every stage keys its per-instance state by it (sequencer cursors, index slots, the fleet registry,
ledger and scoring tables), so it sits below all of them."""

InstanceKey = tuple[str, int]
