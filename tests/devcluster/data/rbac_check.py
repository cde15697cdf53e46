"""Runs inside a process-node pod: uses the pod's own service-account kubeconfig ($KUBECONFIG)
to list Pods and Secrets in its namespace. Exit 0 only if Pods are allowed and Secrets are
forbidden (HTTP 403); prints what it saw."""

import os
import sys

from kubernetes import client, config
from kubernetes.client.rest import ApiException

config.load_kube_config()  # from $KUBECONFIG, as a pod's client would
api = client.CoreV1Api()
namespace = os.environ["POD_NAMESPACE"]
pods = api.list_namespaced_pod(namespace)
print(f"pods: allowed, {len(pods.items)} listed", flush=True)
try:
    api.list_namespaced_secret(namespace)
    print("secrets: allowed", flush=True)
    sys.exit(1)
except ApiException as e:
    print(f"secrets: status {e.status}", flush=True)
    sys.exit(0 if e.status == 403 else 2)
