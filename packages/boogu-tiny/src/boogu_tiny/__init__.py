"""The tiny Boogu organism's builds, out of the trainer: the scenes pretraining (`scenes_pretrain`,
``boogu-tiny-pretrain``) and the Edit pretraining (`edit_pretrain`, ``boogu-tiny-edit-pretrain``).

The random build, the install of the committed checkpoints and their manifest stay in
``boogu_adapters.tiny`` (``boogu-tiny``) for now: the trainer installs them at run time
(``model.tiny``), and these builds score with the trainer's scene verifiers, so moving them here
would make the two packages need each other (docs/tiny-model.md).
"""

__version__ = "0.1.0"
