package anchorkv;

/** A failed anchorkv call: the akv_status code and the library's message. */
public class AnchorKVException extends RuntimeException {
  private static final long serialVersionUID = 1L;
  private final int code;

  public AnchorKVException(int code, String message) {
    super(name(code) + ": " + message);
    this.code = code;
  }

  /** The raw akv_status value (pinned across releases). */
  public int code() {
    return code;
  }

  /** The status, or null for a code newer than this binding. */
  public Status status() {
    try {
      return Status.swigToEnum(code);
    } catch (IllegalArgumentException unknown) {
      return null;
    }
  }

  private static String name(int code) {
    String text = AnchorKV.statusString(swigStatus(code));
    int colon = text.indexOf(':');
    return colon < 0 ? text : text.substring(0, colon);
  }

  private static Status swigStatus(int code) {
    try {
      return Status.swigToEnum(code);
    } catch (IllegalArgumentException unknown) {
      return Status.INTERNAL;
    }
  }
}
