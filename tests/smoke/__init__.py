"""Smoke tests against a real engine (tools/smoke.sh)."""
