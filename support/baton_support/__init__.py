"""What Baton's tests and benchmarks share: the condition waiter (`wait`), the tiny random-weight
model factory (`tiny_models`), free loopback ports (`ports`), a bare etcd + kube-apiserver and its
REST client (`apiserver`), the operator as a process with the chart's RBAC (`operator_process`),
engine pods without engines (`fake_engines`, `metrics_servers`) and the generated metrics page
(`metrics_reference`). Never imported by the engine, the router or the operator; benchmarks import
this package, never ``tests``."""
