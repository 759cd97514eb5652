"""vtcampaign: declarative lever campaigns over vtengine."""
from vtengine import _interpret  # noqa: F401  (before anything imports triton)
