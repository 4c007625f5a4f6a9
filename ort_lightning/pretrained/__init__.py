"""Back out to transformers and peft: the folders their ``from_pretrained`` reads, written by their own code.

``record`` (what rebuilds a transformers or peft model, written beside the artifacts at export),
``rebuild`` (the model again from that record, and the trained values into it), ``writer`` (the
values written through the model's own ``save_pretrained``, merged on request). Reading the
values out of a module or a checkpoint file is the training side's
(`ort_lightning.training.checkpointing.pretrained`); the public entry is
``ort_lightning.save_pretrained``.
"""
