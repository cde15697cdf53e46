"""Baton's process-node agent: registers fake nodes and runs every pod bound to them as local
processes on loopback pod IPs (a small kubelet for tests and the demo)."""
