// The dpbusd paths of the group-wise kernel (int8_group_avx2.cpp, int8_group_avx512.cpp), included inside each
// instruction set's namespace so that the template is compiled for that target (GCC gives a template the target of the
// region it is defined in; one defined outside the AVX-512 region would pass zmm registers through memory).
// They share everything but the instruction, which Base supplies: u = q + 128 as unsigned bytes, and each
// group's lanes start at -128 * (the sum of its weights over the same lanes), so they end at sum q w
// exactly. No include guard, on purpose.

template <typename Base>
struct DpbusdPath : Base {
  using reg = typename Base::reg;
  using W = reg;
  static W wload(const int8_t* p) { return Base::load(p); }
  static reg group_start(const int8_t* w, int64_t G) {
    reg corr = Base::zero();
    for (int64_t c = 0; c < G; c += Base::kBytes) corr = Base::dpbusd(corr, Base::c128(), Base::load(w + c));
    return Base::sub(Base::zero(), corr);
  }
  static reg dot(reg acc, const W& w, const uint8_t* x) { return Base::dpbusd(acc, Base::load(x), w); }
};
