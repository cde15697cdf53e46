"""The autoscaler: a pure policy (spec, observations, history, now) -> decision, and metrics collection.

``policy_types`` holds the policy's inputs and outputs (independent of the CRD models), ``policy``
the decision function, ``metrics`` the parsing and scraping of engine ``/metrics``. Applying a
decision (patching Deployments, Events, status) is the operator handlers' job.
"""
