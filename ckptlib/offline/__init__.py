"""Tools that work on checkpoints outside a training job: convert, export, diff, plan.

- `convert`: between checkpoint formats, one tensor in memory at a time;
- `export`: one consolidated model in Hugging Face's layout;
- `diff`: which tensors differ between two checkpoints of any formats and world sizes, element
  by element by the exact rules of `diff_values`;
- `plan_load`: a dry run of a resharded load from metadata alone (`ckpt plan`), from what each rank
  asks for (`plan_layouts`) and the storage reads that makes (`plan_reads`).
"""
