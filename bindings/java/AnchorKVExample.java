// Compress one layer's KV cache ~10x, decode a new token, compare with exact attention;
// then check the binding's contract (exactness over the reconstruction, serialization,
// errors, ownership). Exits non-zero on any failed check.
import anchorkv.AnchorKV;
import anchorkv.AnchorKVException;
import anchorkv.Cache;
import anchorkv.CacheStats;
import anchorkv.CompressOptions;
import anchorkv.Context;
import anchorkv.DType;
import anchorkv.HeadStats;
import anchorkv.Method;
import anchorkv.Shape;
import anchorkv.Status;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;

public final class AnchorKVExample {
  static final int H = 2, HQ = 4, S = 1024, D = 64, W = 32; // KV heads, query heads, prompt, head dim, window

  static long rngState = 0x2545f4914f6cdd1dL;

  static double uniform() { // xorshift64
    rngState ^= rngState << 13;
    rngState ^= rngState >>> 7;
    rngState ^= rngState << 17;
    return ((rngState >>> 11) + 0.5) / 9007199254740992.0;
  }

  static double gaussian() {
    return Math.sqrt(-2.0 * Math.log(uniform())) * Math.cos(6.283185307179586 * uniform());
  }

  /** NeoX RoPE (base 10000) of one row at `position`: what the model applied to its keys. */
  static double[] rope(float[] x, int offset, int position) {
    double[] out = new double[D];
    for (int i = 0; i < D / 2; ++i) {
      double angle = position * Math.pow(10000.0, -(double) i / (D / 2));
      double a = x[offset + i], b = x[offset + i + D / 2];
      out[i] = a * Math.cos(angle) - b * Math.sin(angle);
      out[i + D / 2] = b * Math.cos(angle) + a * Math.sin(angle);
    }
    return out;
  }

  /** A direct buffer in native order: what the binding reads and writes. */
  static ByteBuffer direct(int floats) {
    return ByteBuffer.allocateDirect(floats * 4).order(ByteOrder.nativeOrder());
  }

  static ByteBuffer direct(float[] values) {
    ByteBuffer buffer = direct(values.length);
    buffer.asFloatBuffer().put(values);
    return buffer;
  }

  static float[] floats(ByteBuffer buffer, int count) {
    float[] out = new float[count];
    buffer.asFloatBuffer().get(out);
    return out;
  }

  /** Exact attention of queries [HQ][D] over rotated keys [H][T] rows and values [H][T][D]. */
  static double[] attention(float[] query, double[][] keys, float[] values, int tokens) {
    return attention(query, keys, values, tokens, null, null);
  }

  /** attention, and each row's log-sum-exp (natural log of its softmax denominator) in lse[HQ];
   * penalty (Cache.logitPenalty, [H][T], or null): each logit lowered by penalty * |q|^2 / D. */
  static double[] attention(float[] query, double[][] keys, float[] values, int tokens, double[] lse, float[] penalty) {
    double[] out = new double[HQ * D];
    for (int j = 0; j < HQ; ++j) {
      int h = j / (HQ / H);
      double[] logits = new double[tokens];
      double max = Double.NEGATIVE_INFINITY, total = 0, q2 = 0;
      for (int d = 0; d < D; ++d) q2 += (double) query[j * D + d] * query[j * D + d] / D;
      for (int t = 0; t < tokens; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += keys[h * tokens + t][d] * query[j * D + d];
        logits[t] = dot / Math.sqrt(D) - (penalty == null ? 0 : penalty[h * tokens + t] * q2);
        max = Math.max(max, logits[t]);
      }
      for (int t = 0; t < tokens; ++t) total += (logits[t] = Math.exp(logits[t] - max));
      if (lse != null) lse[j] = max + Math.log(total);
      for (int t = 0; t < tokens; ++t)
        for (int d = 0; d < D; ++d) out[j * D + d] += logits[t] / total * values[(h * tokens + t) * D + d];
    }
    return out;
  }

  static int failures = 0;

  static void check(boolean ok, String what) {
    if (!ok) {
      System.err.println("FAILED: " + what);
      failures++;
    }
  }

  static Status statusOf(Runnable call) {
    try {
      call.run();
      return Status.OK;
    } catch (AnchorKVException error) {
      check(!error.getMessage().isEmpty(), "the exception carries the library's message");
      return error.status();
    }
  }

  public static void main(String[] args) {
    String jni = System.getProperty("anchorkv.jni");
    if (jni != null) System.load(jni);
    else System.loadLibrary("anchorkv_jni");

    // Synthetic layer: keys drift smoothly over 8 directions per head; values are noise.
    double[] basis = new double[H * 8 * D];
    for (int i = 0; i < basis.length; ++i) basis[i] = gaussian();
    float[] keys = new float[H * S * D], values = new float[H * S * D];
    double[][] rotated = new double[H * S][];
    for (int h = 0; h < H; ++h) {
      double[] walk = new double[8];
      for (int t = 0; t < S; ++t) {
        for (int r = 0; r < 8; ++r) walk[r] += gaussian() / Math.sqrt(S);
        for (int d = 0; d < D; ++d) {
          double drift = 0;
          for (int r = 0; r < 8; ++r) drift += walk[r] * basis[(h * 8 + r) * D + d];
          keys[(h * S + t) * D + d] = (float) (drift + 0.3 * gaussian());
        }
        rotated[h * S + t] = rope(keys, (h * S + t) * D, t);
      }
    }
    for (int i = 0; i < values.length; ++i) values[i] = (float) gaussian();
    int[] topics = new int[HQ * 4];
    for (int i = 0; i < topics.length; ++i) topics[i] = (int) (uniform() * (S - W));
    float[] window = new float[HQ * W * D], query = new float[HQ * D];
    for (int j = 0; j < HQ; ++j)
      for (int w = 0; w < W; ++w) queryRow(j, rotated, topics, window, (j * W + w) * D);
    for (int j = 0; j < HQ; ++j) queryRow(j, rotated, topics, query, j * D);

    Shape shape = new Shape(S, H, HQ, D);
    CompressOptions options = new CompressOptions();
    options.setRetainFraction(0.1);
    ByteBuffer keyBuffer = direct(keys), valueBuffer = direct(values), windowBuffer = direct(window);
    ByteBuffer queryBuffer = direct(query), out = direct(HQ * D);

    Context context = new Context();
    Cache cache = context.compress(shape, DType.F32, keyBuffer, valueBuffer, windowBuffer, options);
    cache.decode(queryBuffer, DType.F32, 1, out);
    float[] decoded = floats(out, HQ * D);
    double[] expected = attention(query, rotated, values, S);
    double dot = 0, normOut = 0, normExpected = 0;
    for (int i = 0; i < HQ * D; ++i) {
      dot += decoded[i] * expected[i];
      normOut += (double) decoded[i] * decoded[i];
      normExpected += expected[i] * expected[i];
    }
    double cosine = dot / Math.sqrt(normOut * normExpected);
    CacheStats stats = cache.stats();
    check(stats.getCompressedBytes() == AnchorKV.compressedBytes(options, shape), "compressed_bytes is known up front");
    check(stats.getCompressedBytes() <= stats.getBudgetBytes(), "the footprint stays within the budget");
    check(stats.getMethod() == Method.ANCHORKV, "AnchorKV is the default method");
    check(cosine > 0.8, "close to exact attention (cosine " + cosine + ")");

    // Decode is exact attention over the cache's own reconstruction, each reconstructed token's
    // logit lowered by its share of logit_correction (Cache.logitPenalty).
    ByteBuffer denseKeys = direct(H * S * D), denseValues = direct(H * S * D), penaltyBuffer = direct(H * S);
    cache.reconstruct(DType.F32, true, denseKeys, denseValues);
    cache.logitPenalty(penaltyBuffer);
    float[] penalty = floats(penaltyBuffer, H * S);
    float[] reconstructedKeys = floats(denseKeys, H * S * D);
    double[][] reconstructedRows = new double[H * S][D];
    for (int row = 0; row < H * S; ++row)
      for (int d = 0; d < D; ++d) reconstructedRows[row][d] = reconstructedKeys[row * D + d];
    double[] expectedLse = new double[HQ];
    double[] overReconstruction =
        attention(query, reconstructedRows, floats(denseValues, H * S * D), S, expectedLse, penalty);
    double worst = 0;
    for (int i = 0; i < HQ * D; ++i) worst = Math.max(worst, Math.abs(decoded[i] - overReconstruction[i]));
    check(worst < 2e-5, "decode equals attention over the reconstruction (max diff " + worst + ")");

    // Each row's log-sum-exp (decodeLse), against the reconstruction's softmax denominator.
    ByteBuffer lse = direct(HQ), outWithLse = direct(HQ * D);
    cache.decodeLse(queryBuffer, DType.F32, 1, outWithLse, lse);
    check(outWithLse.equals(out), "decodeLse writes decode's output");
    float[] lseValues = floats(lse, HQ);
    double lseWorst = 0;
    for (int j = 0; j < HQ; ++j) lseWorst = Math.max(lseWorst, Math.abs(lseValues[j] - expectedLse[j]));
    check(lseWorst < 1e-4, "the log-sum-exp of every row (max diff " + lseWorst + ")");
    check(statusOf(() -> cache.decodeLse(queryBuffer, DType.F32, 1, outWithLse, direct(HQ - 1))) == Status.INVALID_ARGUMENT,
          "an lse buffer too small is refused");

    // Serialize, deserialize, decode again: the same answer.
    ByteBuffer bytes = ByteBuffer.allocateDirect((int) cache.serializedSize());
    long written = cache.serialize(bytes);
    bytes.limit((int) written);
    Cache restored = context.deserialize(bytes.slice());
    ByteBuffer again = direct(HQ * D);
    restored.decode(queryBuffer, DType.F32, 1, again);
    check(again.equals(out), "a deserialized cache decodes identically");

    // Compaction folds the appended tokens (all but the last W) back into the compressed form.
    Cache growing = context.compress(shape, DType.F32, keyBuffer, valueBuffer, windowBuffer, options);
    check(statusOf(() -> growing.compact(windowBuffer, DType.F32, 0)) == Status.INVALID_ARGUMENT,
          "nothing to fold before W tokens were appended");
    for (int t = 0; t < 2 * W; ++t) growing.append(direct(H * D), direct(H * D), DType.F32, 1);
    growing.compact(windowBuffer, DType.F32, 0);
    CacheStats folded = growing.stats();
    check(folded.getAppendedTokens() == 0 && folded.getShape().getSeqLen() == S + 2 * W,
          "compact makes the appended tokens part of the compressed prompt");
    check(folded.getCompressedBytes() <= folded.getBudgetBytes(), "a compacted cache stays within its budget");

    // Errors: the library's status and message, or the binding's own size checks.
    CompressOptions tiny = new CompressOptions();
    tiny.setRetainFraction(0.001);
    check(statusOf(() -> context.compress(shape, DType.F32, keyBuffer, valueBuffer, windowBuffer, tiny)) == Status.BUDGET,
          "a too small budget raises BUDGET");
    check(statusOf(() -> cache.decode(queryBuffer, DType.F32, 1, direct(HQ * D - 1))) == Status.INVALID_ARGUMENT,
          "a short output buffer is refused before the library writes");
    check(statusOf(() -> cache.decode(queryBuffer, DType.F32, 2, out)) == Status.INVALID_ARGUMENT,
          "q_len 2 without appended tokens is refused");
    try {
      cache.decode(ByteBuffer.allocate(HQ * D * 4), DType.F32, 1, out);
      check(false, "a heap buffer is refused");
    } catch (IllegalArgumentException expectedError) {
      // direct buffers only: a heap buffer has no stable address
    }
    // Tensors in Java's default (big-endian) order would be read as garbage: refused. Serialized
    // bytes take any order (the deserialize above read a big-endian slice).
    ByteBuffer bigEndianQuery = ByteBuffer.allocateDirect(HQ * D * 4);
    bigEndianQuery.asFloatBuffer().put(query);
    for (int which = 0; which < 2; ++which) {
      try {
        if (which == 0) cache.decode(bigEndianQuery, DType.F32, 1, out);
        else cache.decode(queryBuffer, DType.F32, 1, ByteBuffer.allocateDirect(HQ * D * 4));
        check(false, "a big-endian " + (which == 0 ? "query" : "output") + " buffer is refused");
      } catch (IllegalArgumentException expectedError) {
        check(expectedError.getMessage().contains("byte order"), "the refusal names the byte order");
      }
    }
    try {
      context.compress(shape, DType.F32, ByteBuffer.allocateDirect(keys.length * 4), valueBuffer, windowBuffer, options);
      check(false, "big-endian keys are refused");
    } catch (IllegalArgumentException expectedError) {
      // as above
    }
    restored.decode(queryBuffer, DType.F32, 1, again);
    check(again.equals(out), "the refused calls left the cache as it was");

    // Every method through the same calls; the options start from the method's paper setup.
    CompressOptions snap = new CompressOptions(Method.SNAPKV);
    check(snap.getWindow() == 64 && snap.getPoolKernel() == 5, "SnapKV starts from the paper's KVPress setup");
    snap.setWindow(W);
    snap.setRetainFraction(0.2);
    try (Cache evicted = context.compress(shape, DType.F32, keyBuffer, valueBuffer, windowBuffer, snap)) {
      check(evicted.stats().getMethod() == Method.SNAPKV, "a SnapKV cache");
      evicted.decode(queryBuffer, DType.F32, 1, again);
    }

    // Head stats: AnchorKV represents every prompt position in every head.
    HeadStats[] heads = cache.headStats();
    check(heads.length == H, "one HeadStats per KV head");
    for (HeadStats head : heads)
      check(head.getKeptTokens() == S && head.getAnchors() == stats.getAnchors(), "AnchorKV keeps all S positions per head");

    // decodeBatch: both caches at once, each as its own decode.
    ByteBuffer twoQueries = direct(2 * HQ * D), twoOut = direct(2 * HQ * D);
    for (int b = 0; b < 2; ++b) twoQueries.asFloatBuffer().position(b * HQ * D).put(query);
    context.decodeBatch(new Cache[] {cache, restored}, twoQueries, DType.F32, 1, twoOut);
    float[] batched = floats(twoOut, 2 * HQ * D);
    for (int i = 0; i < 2 * HQ * D; ++i)
      check(batched[i] == decoded[i % (HQ * D)], "decodeBatch equals single decodes");

    // Positions: the default 0..S-1 given explicitly compress to the same bytes; an appended
    // token may jump ahead.
    ByteBuffer positions = ByteBuffer.allocateDirect(S * 4).order(ByteOrder.nativeOrder());
    for (int t = 0; t < S; ++t) positions.putInt(t * 4, t);
    try (Cache positioned = context.compress(shape, DType.F32, keyBuffer, valueBuffer, windowBuffer, positions, options)) {
      ByteBuffer positionedBytes = ByteBuffer.allocateDirect((int) positioned.serializedSize());
      positionedBytes.limit((int) positioned.serialize(positionedBytes));
      check(positionedBytes.equals(bytes), "explicit positions 0..S-1 are the default");
      ByteBuffer later = ByteBuffer.allocateDirect(4).order(ByteOrder.nativeOrder()).putInt(0, S + 10);
      positioned.append(direct(H * D), direct(H * D), DType.F32, 1, later);
      check(positioned.stats().getAppendedTokens() == 1, "a token appended at its own position");
    }

    // Explicit RoPE frequencies (Llama-3, YaRN tables): the base's own table decodes as the
    // base does; a table of another length is refused before the library reads it.
    float[] table = new float[D / 2];
    for (int i = 0; i < D / 2; ++i) table[i] = (float) Math.pow(10000.0, -(double) i / (D / 2));
    CompressOptions byTable = new CompressOptions(Method.FULLKV), byBase = new CompressOptions(Method.FULLKV);
    byTable.setInvFreq(direct(table));
    ByteBuffer viaTable = direct(HQ * D), viaBase = direct(HQ * D);
    try (Cache a = context.compress(shape, DType.F32, keyBuffer, valueBuffer, null, byTable);
         Cache b = context.compress(shape, DType.F32, keyBuffer, valueBuffer, null, byBase)) {
      a.decode(queryBuffer, DType.F32, 1, viaTable);
      b.decode(queryBuffer, DType.F32, 1, viaBase);
      float[] x = floats(viaTable, HQ * D), y = floats(viaBase, HQ * D);
      double differs = 0;
      for (int i = 0; i < HQ * D; ++i) differs = Math.max(differs, Math.abs(x[i] - y[i]));
      check(differs < 1e-3, "an explicit inv_freq table equal to the base's decodes alike (max diff " + differs + ")");
    }
    for (int i = 0; i < D / 2; ++i) table[i] = (float) Math.pow(500000.0, -(double) i / (D / 2)); // Llama-3's base
    byTable.setInvFreq(direct(table));
    try (Cache other = context.compress(shape, DType.F32, keyBuffer, valueBuffer, null, byTable)) {
      other.decode(queryBuffer, DType.F32, 1, viaTable);
      check(!viaTable.equals(viaBase), "another inv_freq table rotates the keys otherwise");
    }
    byTable.setInvFreq(direct(new float[D / 2 - 1]));
    check(statusOf(() -> context.compress(shape, DType.F32, keyBuffer, valueBuffer, null, byTable)) == Status.INVALID_ARGUMENT,
          "an inv_freq table of the wrong length is refused");

    // Ownership: a closed context lives on for its caches; cacheDestroy (%delobject) releases.
    context.close();
    cache.decode(queryBuffer, DType.F32, 1, again);
    check(again.equals(out), "a cache outlives the close() of its context");
    AnchorKV.cacheDestroy(restored);
    check(statusOf(() -> restored.serializedSize()) == Status.INVALID_ARGUMENT, "a destroyed cache is a NULL handle");
    cache.close();
    cache.close(); // idempotent

    System.out.printf("anchorkv Java: %.1fx smaller (%d of %d bytes), cosine to exact attention %.4f%n",
                      stats.getRatio(), stats.getCompressedBytes(), stats.getFullBytes(), cosine);
    if (failures > 0) {
      System.err.println(failures + " check(s) failed");
      System.exit(1);
    }
  }

  /** A query of head j that looks for one of its "topic" tokens. */
  static void queryRow(int j, double[][] rotated, int[] topics, float[] into, int offset) {
    double[] key = rotated[(j / (HQ / H)) * S + topics[j * 4 + (int) (uniform() * 4)]];
    double norm = 0;
    for (double k : key) norm += k * k;
    for (int d = 0; d < D; ++d) into[offset + d] = (float) (3.0 * key[d] / Math.sqrt(norm) * Math.pow(D, 0.25) + 0.5 * gaussian());
  }
}
