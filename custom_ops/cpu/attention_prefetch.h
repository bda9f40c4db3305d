// What an attention tile asks for (prefetches) while it computes: its own later spans and the next tile's first.
// Included by kernel_impl.h inside an instruction set's `#pragma GCC target` region and namespace; no
// include guard, only builtins and own code (see kernel_impl.h).

// Asks for the cache lines of keys [cursor, end_key) of a tile (keys and values of the tile's kv heads,
// adjacent in each slot), a few slots at a time: `step` slots per ask, from where the last ask stopped.
// Every line, keys into L2 (or L1 just before they are scored) and values into L2: at 64 decodes in bf16 (attention
// stage, paired in one process) asking every other line measured 1.52x, both into L1 1.50x, both with the T2
// hint 1.08x, both non-temporal 1.58x.
template <class Cache>
struct SpanPrefetch {
  const AttentionTile<Cache>* tile = nullptr;
  int64_t end_key = 0, cursor = 0, step = 0, bytes = 0;
  int64_t block = 0, within = 0;  // the cursor's block-table entry and slot in it (no division per slot)
  int key_locality = 2;  // keys into L2, or into L1 (3) when they are scored right after

  SpanPrefetch() = default;
  // Keys [from, to) of `of`, asked for in about `asks` asks (0: at once); `into_l1` for the keys.
  SpanPrefetch(const AttentionTile<Cache>* of, int64_t from, int64_t to, int64_t asks, bool into_l1 = false)
      : tile(of), end_key(to), cursor(from), block(from / of->block_size), within(from % of->block_size),
        key_locality(into_l1 ? 3 : 2) {
    step = asks > 0 ? (to - from + asks - 1) / asks : to - from;
    bytes = of->num_tile_kv_heads * kv_row_elements<Cache>(of->head_dim) * static_cast<int64_t>(sizeof(Cache));
  }
  // The span of `of` from key `span`.
  static SpanPrefetch span_of(const AttentionTile<Cache>* of, int64_t span, int64_t asks, bool into_l1 = false) {
    const int64_t end = of->key_end;
    return SpanPrefetch(of, span, end - span < kKeySpan ? end : span + kKeySpan, asks, into_l1);
  }

  // The next `step` slots: their keys' lines, then their values' (two runs, one per cache, rather than the two
  // caches' lines taking turns: the decode attention stage at 64 sequences of 128 keys, paired step by step in one
  // process, bf16 0.958, 0.969, 0.961 of the old order's time).
  inline void operator()() {
    const int64_t stop = cursor + step < end_key ? cursor + step : end_key;
    if (cursor >= stop) return;
    const AttentionTile<Cache>& t = *tile;
    int64_t slot_block = block, slot_within = within;
    const Cache* const caches[2] = {t.key_cache, t.value_cache};
    for (int pass = 0; pass < 2; ++pass) {
      const Cache* cache = caches[pass];
      const int locality = pass == 0 ? key_locality : 2;
      slot_block = block, slot_within = within;
      for (int64_t key = cursor; key < stop; ++key) {
        const int64_t slot = t.block_ids[slot_block] * t.block_size + slot_within;
        if (++slot_within == t.block_size) slot_within = 0, ++slot_block;
        const char* rows = reinterpret_cast<const char*>(
            cache + (slot * t.num_kv_heads + t.kv_head) * kv_row_elements<Cache>(t.head_dim));
        for (int64_t line = 0; line < bytes; line += 64) {
          if (locality == 3) {
            __builtin_prefetch(rows + line, 0, 3);
          } else {
            __builtin_prefetch(rows + line, 0, 2);
          }
        }
      }
    }
    cursor = stop, block = slot_block, within = slot_within;
  }

  // Every slot not yet asked for.
  inline void all() {
    step = end_key - cursor;
    (*this)();
  }

  // Every slot before `key` not yet asked for; the pace of later asks unchanged.
  inline void through(int64_t key) {
    const int64_t pace = step;
    step = key - cursor;
    if (step > 0) (*this)();
    step = pace;
  }
};

// What a tile asks for while it computes: its own keys after its first span (a decode's: one query), then
// the next tile's first span (the thread's next tile), `step` slots per ask, so that both are asked for by
// the end of the tile at about the pace its keys are used, each span while the span before it computes.
// A tile of several queries (a prefill's) asks for each later span at once when it begins, as before
// (spreading them measured no faster there, and the whole-step prefill figures moved the wrong way).
// The pace matters at 64 decodes (bf16 cache, 30 layers, 2 threads of an AMD EPYC Zen 4; attention stage us,
// paired step by step in one process against this pace): no asks 16145 / 8490; the next tile's first span at
// once when the tile begins 13500 / 8081; everything at once 14137 / 8519; 2 slots per ask 11475 / 8887, 4 per
// ask 12189 / 8345; 1 slot every other ask 10117 / 7606; 2 slots every other ask (the same pace) 7531 / 7400.
// Asking faster or slower than the keys are used both lose.
template <class Cache>
struct TileAsks {
  SpanPrefetch<Cache> own, next;
  bool spreads_own = false;

  TileAsks(const AttentionTile<Cache>& t, int64_t num_asks) : spreads_own(t.num_queries == 1) {
    const int64_t second_span = t.key_begin + kKeySpan;
    if (spreads_own && t.key_end > second_span) own = SpanPrefetch<Cache>(&t, second_span, t.key_end, 0);
    if (t.next) next = SpanPrefetch<Cache>::span_of(t.next, t.next->key_begin, 0);
    const int64_t slots = (own.end_key - own.cursor) + (next.end_key - next.cursor);
    own.step = next.step = num_asks > 0 ? (slots + num_asks - 1) / num_asks : slots;
  }

  inline void operator()() {
    if (own.cursor < own.end_key) {
      own();
    } else {
      next();
    }
  }

  // The lines of the tile's span from key `span` not yet asked for (it is about to be scored): the first
  // span's unless the tile before asked for them, a later span's at once, or what a decode's asks left.
  inline void span_begins(const AttentionTile<Cache>& t, int64_t span) {
    if (span == t.key_begin) {
      if (!t.first_span_prefetched) SpanPrefetch<Cache>::span_of(&t, span, 0, true).all();
    } else if (spreads_own) {
      own.through(SpanPrefetch<Cache>::span_of(&t, span, 0).end_key);
    } else {
      SpanPrefetch<Cache>::span_of(&t, span, 0, true).all();
    }
  }

  inline void all() {
    own.all();
    next.all();
  }
};
