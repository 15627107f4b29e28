"""Shared test support: PostgreSQL fixtures (`pg`) and a cuttable TCP proxy (`tcp_proxy`)."""
