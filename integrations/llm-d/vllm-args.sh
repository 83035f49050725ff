# vLLM pod arguments for llm-d precise prefix routing with tpusync's host/disk tier.
# POD_IP and MODEL come from the pod spec (downward API); EPP_HOST is the EPP service.
# The connector adds its tier events (medium CPU, DISK) to vLLM's own KV-event stream
# (take_events), so one publisher per pod carries GPU and tpusync tiers with one sequence.
# The connector is found through its vllm.general_plugins entry point (docs/vllm.md).
vllm serve "$MODEL" \
  --block-size 16 \
  --prefix-caching-hash-algo sha256_cbor \
  --kv-transfer-config '{"kv_connector":"TpusyncConnector",
                         "kv_role":"kv_both",
                         "kv_connector_extra_config":{"host_bytes":34359738368,"pod_id":"'"$POD_IP"'"}}' \
  --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
                       "endpoint":"tcp://'"$EPP_HOST"':5557",
                       "topic":"kv@'"$POD_IP"'@'"$MODEL"'"}'
# Do NOT also set kv_connector_extra_config.kv_events_endpoint here: that starts tpusync's own
# publisher (it binds, for routers that connect to each pod) and llm-d would see the tier events
# twice on two sequences. Use it when the router subscribes per pod (llm-d discoverPods: true,
# or tpusync.core.routing.KVEventSubscriber) and vLLM's own publisher is off.
