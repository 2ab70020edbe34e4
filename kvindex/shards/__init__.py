"""Index shards over NATS (docs/shards.md): shard processes that each own a partition of the fleet's
workers, and a front that fans a Score's match out to them and ranks with the one ranker."""
