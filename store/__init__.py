"""The store: its writer (:mod:`store.writer`: the schema, the shards, the views), its read-only
connection (:mod:`store.db`), the per-run rollups (:mod:`store.rollup`), the one hit rate
(:mod:`store.hit_rate`) and every read query (:mod:`store.queries`). The one layer that holds SQL
besides ``data/schema.sql``; it imports only the ground, :mod:`core` (docs/design.md)."""
