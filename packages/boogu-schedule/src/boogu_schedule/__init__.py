"""The Boogu-Image flow-matching math: time-shift schedules, t = 1 - sigma, velocity negation, text CFG, SDE steps with log-probabilities, SDE windows."""

__version__ = "0.1.0"
