"""This project's two-phase weight sync inside a real vLLM server.

Enable it with three settings on the vLLM server::

    VLLM_PLUGINS=omni_router          # loads the endpoint plugin (vLLM loads endpoint plugins only when named;
                                      # the list also allows vLLM's other plugin groups: name those you use too)
    VLLM_SERVER_DEV_MODE=1            # vLLM's own RL routes: /pause, /resume, /is_paused, /weight_info
    vllm serve <checkpoint dir> --worker-extension-cls worker.vllm_plugin.extension.OmniWeightSyncExtension

The server then answers ``/init_weights_update_group``, ``/prepare_weights_update``,
``/complete_weights_update``, ``/abort_weights_update`` and ``/destroy_weights_update_group`` exactly
as omni-worker does. The served model must be a local checkpoint directory (updates are checked
against its safetensors headers) and every update must carry every checkpoint tensor.

Why two parts. vLLM's weight-transfer engine runs ``update_weights`` synchronously on each worker's
main thread for the whole broadcast: it cannot post a receive and answer "ready" before the trainer
broadcasts, and a receive that never gets its data cannot be aborted. The worker extension
(:mod:`worker.vllm_plugin.extension`) receives on a thread of its own (the project's
``BucketReceiver``), so prepare answers "ready" while the rank stays free, and complete applies,
verified, through vLLM's loader. The endpoint plugin (:mod:`worker.vllm_plugin.endpoints`) lets the
server speak the two-phase contract natively, so a trainer or a router needs no translation.
"""
