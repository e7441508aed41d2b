"""Tensors another process on this host shares with the worker: CPU shared memory and CUDA IPC handles.

Every form is checked against the served model before any memory is opened, and each decoder
returns the step that opens the memory and copies the tensors out, run later inside the update:

* :mod:`.json_message`: the project's JSON handle message (:mod:`router.contract.tensor_handles`);
* :mod:`.safe_unpickle`: the restricted unpickler for pickled handles, with the records it builds
  instead of tensors (:mod:`.pickle_records`) and SGLang's wrappers around them (:mod:`.sglang_wrappers`);
* :mod:`.from_tensor_request`: an ``/update_weights_from_tensor`` body (SGLang's route);
* :mod:`.vllm_update_info`: the shared-memory form of vLLM's ``/update_weights``.
"""
