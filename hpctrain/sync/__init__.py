"""Synchronization models as policies over worker clocks (BSP, SSP, ASP)."""
