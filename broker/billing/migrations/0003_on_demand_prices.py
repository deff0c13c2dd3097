import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    # Also the merge point of the billing changes made side by side (user budgets, CPU/memory rates).
    dependencies = [
        ('billing', '0002_user_budgets'),
        ('billing', '0002_cpu_memory_rates'),
        ('tenancy', '0002_team_quota_fair_share'),
    ]

    operations = [
        migrations.CreateModel(
            name='OnDemandPrice',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('day', models.DateField()),
                ('gpu_model', models.CharField(max_length=64)),
                ('usd_per_gpu_hour', models.DecimalField(decimal_places=6, max_digits=14)),
                ('offer', models.CharField(help_text='provider region instance type', max_length=200)),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                             related_name='on_demand_prices', to='tenancy.tenant')),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('tenant', 'day', 'gpu_model'),
                                                        name='uniq_on_demand_price')],
            },
        ),
    ]
