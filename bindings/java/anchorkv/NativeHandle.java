package anchorkv;

import java.lang.ref.Cleaner;
import java.util.function.LongConsumer;

/**
 * The C object behind a proxy, freed exactly once: by the proxy's {@code delete()} or
 * {@code close()}, or by a {@link Cleaner} when the proxy becomes unreachable (in place of
 * SWIG's {@code finalize()}). It holds no reference to the proxy, only the address and how to
 * free it, plus an optional step after (a cache lets its context go).
 */
final class NativeHandle implements Runnable {
  private static final Cleaner CLEANER = Cleaner.create();

  private final LongConsumer destroy;
  private final Cleaner.Cleanable cleanable;
  private long address;
  private Runnable then;

  NativeHandle(Object proxy, long address, LongConsumer destroy) {
    this.address = address;
    this.destroy = destroy;
    this.cleanable = CLEANER.register(proxy, this);
  }

  /** Runs {@code step} after the C object is freed. */
  synchronized void then(Runnable step) { then = step; }

  /** The C object was freed elsewhere (the %delobject C calls): do not free it again. */
  synchronized void disown() { address = 0; }

  /** Frees now (at most once, whoever comes first: this or the Cleaner). */
  void release() { cleanable.clean(); }

  @Override
  public void run() {
    long freed;
    Runnable step;
    synchronized (this) {
      freed = address;
      step = then;
      address = 0;
      then = null;
    }
    if (freed != 0) destroy.accept(freed);
    if (step != null) step.run();
  }
}
