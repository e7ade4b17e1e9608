"""Parallelism of the dense model: data (``data``), tensor (``mappings``, ``layers``,
``cross_entropy``) and pipeline (``schedules``, ``stages``, ``p2p``, ``pipeline``) parallel,
composed over the runtime's ``dp x tp x pp`` grid by ``engine``; ``groups`` runs the traffic
over MPI or torch.distributed; ``bench`` measures pipeline bubbles."""
