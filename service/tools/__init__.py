"""Tools around the service: `blockserve bench` (bench/), the simulator on a virtual clock (simulator.py) with
its model-free worker (fake_worker.py), and the synthetic workloads both draw from (workload.py)."""
