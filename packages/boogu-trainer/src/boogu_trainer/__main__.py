"""``python -m boogu_trainer`` (what ``torchrun -m boogu_trainer`` runs on every rank)."""

import sys

from boogu_trainer.cli import main

sys.exit(main())
