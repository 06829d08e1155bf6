"""`save` and `async_save`: collective, elastic, committed-or-nothing checkpoints.

- `saving`: `save`, `async_save`, `SaveResult` and `transact`, the one save path;
- `async_mode`: `AsyncMode`, how an async save runs (writer process or thread, background staging,
  a staging cap);
- `background_save`: async saves, staged to CPU memory and written in the background;
- `capped_staging`: staging in pieces under `AsyncMode(max_staging_bytes=)`;
- `writer_process` / `writer_child`: the long-lived writer process of `AsyncMode("process")`,
  seen from each side, with `staging_arena` its shared-memory staging;
- `rank_checks`: what every rank of a collective save or load must pass alike."""
