"""The composition root: the `blockserve` command line (cli.py), the supervisor of `blockserve serve`
(supervisor.py) and the Kubernetes Secret of the keys (kube_secret.py). The only place that imports every role;
nothing imports it."""
