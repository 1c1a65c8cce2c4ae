"""What the control plane and the agents must agree on, in one place that imports neither of them.

Pure Python (no Django, nothing from `apps/` or `agents/`): both sides import it, so a rule checked at
submission is the same rule the agent checks before it starts a task.
"""
