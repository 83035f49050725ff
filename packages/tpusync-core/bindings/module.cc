#include "bindings.h"

NB_MODULE(_native, m) {
  m.doc() = "tpusync native core (C++20): host block pools, block index, copy engine.";
  tpusync::bindings::init_base(m);
  tpusync::bindings::init_memory(m);
  tpusync::bindings::init_block(m);
  tpusync::bindings::init_engine(m);
  tpusync::bindings::init_store(m);
  tpusync::bindings::init_transport(m);
}
