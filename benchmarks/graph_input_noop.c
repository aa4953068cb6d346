/* An operator that does nothing with its inputs (MindSpore's AOT signature): copies x[0] to y[0].
   benchmarks/graph_input_cost.py measures what MindSpore spends per graph input and per Parameter
   around it. */
#include <stdint.h>

int noop(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra) {
  ((float *)params[nparam - 1])[0] = ((const float *)params[0])[0];
  return 0;
}
