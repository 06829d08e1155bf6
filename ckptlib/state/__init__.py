"""A user's `state` mapping as DCP state dicts, and back.

- `state`: modules, optimizers, RNG and per-rank values (`RankLocal`, resize policies) flattened
  to DCP state dicts and restored;
- `module_state`: the state dicts of modules, optimizers and stateful objects, with every failure
  a `StateError` naming the key;
- `state_checks`: checks before anything is written (picklable, no two keys flatten to one);
- `sampler`: `ElasticDistributedSampler`, the data-loader position across a data-parallel resize.
"""
