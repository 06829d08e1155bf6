"""The proof matrices behind the tests and ``ckpt validate``: save at N ranks in one layout, load
at M in another, compare bit-exactly and train one more step against a run that never saved.

``parallel_layouts`` (how a model is spread over ranks: ``plain``, ``ddp``, ``fsdp2``, ``hsdp``,
``tp``, ``fsdp2+tp``, ``fsdp1``, ``fsdp1-flat``), ``models`` (the small transformer),
``matrix`` (the save and load sides), ``layout_matrix`` (layout pairs, also of your own model),
``training_states`` and ``validate`` (the run of ``ckpt validate``), and the same proof on a
user's own training job: ``training_spec`` (``TrainingSpec``, ``load_spec``: what ``--spec``
names; torch-free), ``spec_matrix`` (its round trip) and ``elastic_proof`` (``assert_elastic``).
The other modules import torch.
"""
