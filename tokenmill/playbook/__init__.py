"""The serving playbook as commands: ``plan`` (capacity), ``tune`` (lever search), ``run-batch``, ``top``."""
