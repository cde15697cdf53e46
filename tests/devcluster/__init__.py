"""Acceptance tests of the local control plane (issue 6): real etcd, kube-apiserver, controller
manager, scheduler, kwok and Baton's process-node agent."""
