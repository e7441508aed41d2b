"""Who the workers are and whether they may take traffic: the registry, the fleet's weights, groups and LoRA
adapters. The health checks that feed the registry probe through the engines, which act on its workers, so
they sit above both (:mod:`router.gateway.health`)."""
