"""Helpers shared by the tests and the benchmarks (never product code): free loopback ports, a bare
etcd + kube-apiserver, the operator as a process with the chart's RBAC, engine pods without engines.

Benchmarks import from here and from the product, never from `tests`."""
