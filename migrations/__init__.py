"""Alembic migrations of the control plane's PostgreSQL schema."""
