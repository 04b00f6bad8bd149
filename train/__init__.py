"""gradserver.train: the training application built on the client library.

A LLaMA-style model (`model`), the shipped corpus (`corpus`, `data/`), the trainer that overlaps
backward with gradient exchange (`trainer`, `gradient_buffers`, `clipping`), the engines it
exchanges through (`engines`: the coordinator, in-process threads, torch.distributed), the
training job with checkpoints and resume (`training`, `checkpoint`, `fingerprint`), its outputs
(`metrics_log`, `plots`), the synthetic exchange job (`synthetic`) and the `gradserver worker` /
`gradserver launch` commands (`cli`, `launch`).

Needs the `train` extra (torch, tqdm, matplotlib): `pip install 'gradserver[train]'`.
"""
