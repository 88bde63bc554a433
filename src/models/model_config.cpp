#include "models/model_config.h"

#include <algorithm>

#include "core/error.h"

namespace mb {

int ModelConfig::max_head_dim() const {
  int m = 0;
  for (auto& l : layers) m = std::max(m, l.head_dim);
  return m;
}

void check_layer_geometry(const ModelConfig& c, const std::string& source) {
  MB_CHECK(int(c.layers.size()) == c.n_layers && c.n_layers > 0, "{}: {} layer entries for {} layers", source,
           c.layers.size(), c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerConfig& L = c.layers[size_t(i)];
    MB_CHECK(L.head_dim > 0 && L.head_dim % 2 == 0 && L.n_kv_heads > 0 && c.n_heads % L.n_kv_heads == 0 &&
                 L.ffn_dim > 0,
             "{}: layer {} has head_dim {}, {} KV heads for {} query heads and FFN width {}", source, i, L.head_dim,
             L.n_kv_heads, c.n_heads, L.ffn_dim);
    MB_CHECK(L.kv_source >= 0 && L.kv_source <= i, "{}: layer {} reads the KV of layer {}", source, i, L.kv_source);
    const LayerConfig& S = c.layers[size_t(L.kv_source)];
    MB_CHECK(L.head_dim == S.head_dim && L.n_kv_heads == S.n_kv_heads,
             "{}: KV-shared layer {} does not match the geometry of its source layer {}", source, i, L.kv_source);
  }
}

}  // namespace mb
