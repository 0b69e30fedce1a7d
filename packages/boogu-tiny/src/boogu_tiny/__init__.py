"""The tiny Boogu organism (docs/tiny-model.md), its own package below the trainer:

- `checkpoints` (``boogu-tiny``): the random build with the released folder layout, and the install
  of the committed pretrained scenes checkpoint (``assets/tiny_scenes/``) checked against its
  manifest; the trainer calls it at run time for ``model.tiny``.
- `verify`: the scene and scene-edit verifiers (the trainer's ``scene_*`` rewards wrap them).
- `scenes_pretrain` (``boogu-tiny-pretrain``) and `edit_pretrain` (``boogu-tiny-edit-pretrain``): the
  builds of the pretrained checkpoints.
"""

__version__ = "0.1.0"
