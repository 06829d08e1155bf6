"""`save` and `async_save`: collective, elastic, committed-or-nothing checkpoints.

- `saving`: `save`, `async_save` and `SaveResult`;
- `background_save`: async saves, staged to CPU memory and written in a background thread;
- `writer_process` / `writer_child`: the long-lived writer process of `async_mode="process"`, seen
  from each side, with `staging_arena` its shared-memory staging;
- `rank_checks`: what every rank of a collective save or load must pass alike.
"""
