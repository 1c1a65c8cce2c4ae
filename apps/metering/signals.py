"""What metering tells the rest of Klique, without importing it."""

from __future__ import annotations

from django.dispatch import Signal

# Metered GPU time has a cost: user_id, project_id (or None), cost_nano_usd, at. The gateway's wallets
# (gateway.wallets.charge) add it to the live counters of the USD budgets it draws from.
cost_recorded = Signal()
